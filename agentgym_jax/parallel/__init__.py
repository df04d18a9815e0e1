"""Device mesh, partition rules and multi-host initialisation."""
