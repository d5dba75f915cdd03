"""``fedmed console``: a local, read-only web page over what a federation already wrote down (docs/privacy.md,
docs/tracking.md).

Two views, each read afresh from the files on every request:

- a hospital's (``hospital_view``): its audit log's chain, the messages of each run that reached it, what left it,
  its refusals, its epsilon against its budget, its training limits, its policy and approved code;
- the coordinator's (``coordinator_view``): the runs of a results folder, each round's hospitals and bytes, metric
  curves, the best round and its checkpoint, the cross-site table, links to the trackers.

``app`` serves them (Starlette, Jinja2, charts drawn here as inline SVG by ``charts``: nothing is fetched from
anywhere); ``cli`` is the command. Nothing here writes a file.
"""
