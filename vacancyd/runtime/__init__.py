"""Wiring: building the daemon from its settings, binding its listeners, running its loops,
supervising its tasks, and its lifecycle (:mod:`vacancyd.runtime.daemon`).

The daemon's task tree (names as they appear in logs):

* ``api@ADDR`` — the API listener (essential)
* ``listener NAME@ADDR`` — one proxy listener per upstream (essential)
* ``collector RESOURCE`` — one capacity loop per enabled resource (essential)
* ``pressure RESOURCE`` — one GPU pressure loop per enabled GPU with pressure (essential)
* ``calibration saver`` — writes learned thresholds to the state directory (not essential)
* ``state saver`` — writes learned contexts and footprint priors as they change (not
  essential; see vacancyd.runtime.learned)
* ``collector presence`` — the presence loop (headless or logind), when one is configured
  (essential); logind's signals wake it through ``state.samples``
* ``observer NAME`` — server observation for adapters that need it (essential)
* ``owner controls`` — the lending schedule, pauses, the battery rule and exclusive apps
  (essential; ``vacancyd.control.owner``)
* ``reclaim NAME`` — one per reclaim of an upstream, started by an edge (not essential)
* ``track NAME job N`` — follows a tracked borrowed job (ComfyUI prompt) to its end (not
  essential)
* ``hold NAME job N`` — watches a held job's server for idleness (not essential)
* ``reclaim cancel NAME`` / ``warm NAME`` — a reclaim's server calls (not essential)
* ``target listeners`` — which sockets serve each upstream's target, for /status (not
  essential)
* ``free NAME job N`` — an exclusive job's server frees its memory before the card is
  released (not essential)
* ``lendability watcher`` — announces each change of what a borrowed request would get on
  ``/events`` (not essential)
* ``save pause`` — writes a pause that ended by itself (not essential; awaited at shutdown)
* ``presence bus watch`` — notices a dropped logind connection between polls (not essential)
* ``trace post-release sample`` — the span of a post-release fresh sample, with
  ``[telemetry]`` (not essential)
* ``SIGHUP config check`` — re-reads the configuration on SIGHUP (not essential)
* ``headless check`` — with ``presence = "headless"``, asks logind once whether someone sits
  at a local desktop and warns if so (not essential)
* ``service status`` — under systemd, keeps ``STATUS=`` current (not essential)
* ``watchdog`` — ``WATCHDOG=1`` pings when the unit sets ``WatchdogSec=`` (not essential)
* ``kubernetes feeder`` / ``kubernetes publisher`` / ``kubernetes uninstall watcher`` —
  host-side publishing when ``[kubernetes]`` is configured (not essential: the API server
  cannot stop the daemon)

Every one goes through the supervisor (``vacancyd.runtime.tasks``), which holds its
reference and its essential flag; ``tests/component/test_supervision.py`` checks that no
daemon task runs outside it.
"""
