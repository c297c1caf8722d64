"""Engines shardkit runs on, each an optional extra: ``ray`` (``pip install 'shardkit[ray]'``).

An integration only adapts a runner (``shardkit.write.engines``) to its engine; the plan, the
tasks and the commit are ``shardkit.write``'s (``plan``, ``task``, ``commit``), so every engine
writes the same bytes.
"""
