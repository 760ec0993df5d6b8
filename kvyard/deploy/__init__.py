"""Fleets on Ray: placement, discovery, scaling (`kvyard deploy`)."""
