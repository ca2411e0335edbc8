"""The `pdserve` command line."""
