"""HTTP/1.1 on asyncio protocols, for the hot paths where general-purpose frameworks cost too much CPU:
the benchmark's load client and the router's proxy. Imports nothing else from kvyard."""
