"""RRef glue (stub while the protocol lands)."""
def attach(agent):
    pass
def detach(agent, check_leaks=True):
    return None
def graceful_delete(agent, timeout):
    pass
