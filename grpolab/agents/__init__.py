"""Multi-turn agent episodes: environments, tools, token-exact turn deltas, episode records.

Importing this package imports nothing heavy; each module states its own dependencies.
"""
