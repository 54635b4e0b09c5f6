"""Stand-ins for the real things the fleet tests cannot have; each module says what it imitates."""
