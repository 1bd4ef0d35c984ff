"""The wire layer: what every length-prefixed protocol and datagram of RAPS is made of.

``framing`` (the one framing module: frames, MACs, readers), ``gate`` (connection slots
bounded per source), ``keyfile`` (the cluster key and node keys on disk), ``heartbeat``
(the signed datagram codec and node keys), ``replay_guard`` (incarnations and counters
of those datagrams) and ``_udp`` (the compiled batch receive and send of heartbeats, with
``heartbeat``'s pure-Python path as its fallback).
"""
