"""HTTP routes, one router per area."""
