"""Small backend-neutral helpers shared by the core (no vendor names, no device access of their own)."""
