"""What every HTTP listener shares: bearer-token authentication and the daemon's metric
registry and counters.

Below the proxy, the control layer and the API in the layer order, so each of them can
count and authenticate without importing another's internals.
"""
