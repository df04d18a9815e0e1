"""TextCraft: Minecraft crafting from the `textcraft` package recipes (AgentGym rules)."""
