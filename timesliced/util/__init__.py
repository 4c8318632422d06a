"""Small helpers shared by several layers: statistics and parsing (pure), processes and asyncio compatibility."""
