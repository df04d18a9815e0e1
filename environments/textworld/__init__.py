"""TextWorld household games (the ALFWorld role): seeded games generated offline, played with Jericho."""
