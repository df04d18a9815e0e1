"""AgentGym's tool environments (Weather, Movie, Academia, TODOList, Sheet) on packaged data."""
