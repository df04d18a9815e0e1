"""BabyAI on minigrid: AgentGym's 40 levels as text, high-level actions compiled by path search."""
