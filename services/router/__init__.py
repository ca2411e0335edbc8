"""The router's core: placement, admission, the generation routes and the migration loop, the workers it knows."""
