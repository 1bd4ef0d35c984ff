"""Pure decisions, no I/O: they take snapshots and return frozen decisions.

Modules: ``placement`` (backup groups, spare order); detector, planner and health
policy live beside it. Import the submodule you need; nothing is re-exported here.
"""
