"""The HTTP edge: everything between the socket and Detour's routes."""
