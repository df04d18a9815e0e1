"""Room: the Maze's navigation task in small open rooms, sized for the CPU quickstart."""
