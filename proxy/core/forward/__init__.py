"""Forwarding one proxied request, stage by stage: intake (what infertap reads of the body), attempts
(one upstream call up to its commit point, across retries and fallbacks), lifetime (the client's
disconnect, the total deadline, shutdown), relay (a committed answer to the client); forwarder.py
runs them in order and fires the request's hooks."""

from proxy.core.forward.forwarder import Forwarder

__all__ = ["Forwarder"]
