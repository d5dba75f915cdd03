"""Flower's strategy wrappers (its DP wrappers) around one of ours: found, and refused where they cannot work."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

from flwr.serverapp.strategy import Strategy

from common.config import ConfigError
from common.methods.registry import method_spec, methods

log = logging.getLogger("fedmed")


def wrappers_of(strategy: Strategy) -> list[Strategy]:
    """The strategies wrapping ``strategy``, outermost last. A Flower wrapper (its DP wrappers, a user's own) is built
    around a strategy without telling it and holds it as ``wrapper.strategy``: so the wrappers are the strategies that
    hold this one there (and their own wrappers in turn), found by what refers to it, whichever of them is calling.
    (One pass over Python's tracked objects per wrapper level: it runs once, before round 1.)"""
    found: list[Strategy] = []
    inner = strategy
    while True:
        outer = next((holder for holder in holders_of(inner) if holder is not inner
                      and getattr(holder, "strategy", None) is inner and holder not in found), None)
        if outer is None:
            return found
        found.append(outer)
        inner = outer


def holders_of(value: object) -> Iterator[Strategy]:
    """The strategies that refer to ``value``: directly, or through their instance ``__dict__``."""
    for referrer in gc.get_referrers(value):
        if isinstance(referrer, dict):  # an instance's attributes, once Python made them a dict
            yield from (owner for owner in gc.get_referrers(referrer)
                        if isinstance(owner, Strategy) and vars(owner) is referrer)
        elif isinstance(referrer, Strategy):
            yield referrer


class FlowerWrappers:
    """A mixin of HospitalStrategy, not a part it holds: what it looks for is what holds the strategy object itself
    (a part would hold only that one reference back to it, and be found among its holders)."""

    def wrappers(self) -> list[Strategy]:
        """The strategies wrapping this one, outermost last: :func:`wrappers_of`."""
        return wrappers_of(self)

    def refuse_unfit_wrappers(self) -> None:
        """:meth:`check_wrappers` once per strategy (its search of the heap costs a fraction of a second in a large
        process): at ``summary``, or at the first ``configure_train`` under a loop that skips it."""
        if not self._wrappers_checked:
            self.check_wrappers()
            self._wrappers_checked = True

    def check_wrappers(self) -> None:
        """A ConfigError, before round 1 (Flower's loop calls ``summary`` first), when one of Flower's DP wrappers
        wraps a method whose replies it cannot clip tensor by tensor against the model it sent
        (``MethodSpec.not_for_central_dp``) or a strategy with secure aggregation; where a client-side wrapper is
        fit, a warning that hospitals must clip with Flower's mod."""
        from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping as ClientAdaptive
        from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping as ClientFixed
        from flwr.serverapp.strategy.dp_adaptive_clipping import DifferentialPrivacyAdaptiveBase
        from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase

        dp = [w for w in self.wrappers() if isinstance(w, (DifferentialPrivacyFixedClippingBase,
                                                            DifferentialPrivacyAdaptiveBase))]
        if not dp:
            return
        wrapper = f"Flower's {type(dp[0]).__name__} cannot wrap {type(self).__name__} (method {self.job.strategy!r})"
        why = method_spec(self.job.strategy).not_for_central_dp
        if why:
            fit = ", ".join(name for name, spec in methods().items() if not spec.not_for_central_dp)
            raise ConfigError(f"{wrapper}: {why}. Nothing was sent to the hospitals. Central DP fits the methods whose "
                              f"reply is the model ({fit}); for this method use each hospital's own local DP (its "
                              "policy's local-dp, docs/privacy.md)")
        why = self.workflow.central_dp_problem()
        if why:
            raise ConfigError(f"{wrapper} {why}")
        client_side = [w for w in dp if isinstance(w, (ClientFixed, ClientAdaptive))]
        if client_side:
            mod = "adaptiveclipping_mod" if isinstance(client_side[0], ClientAdaptive) else "fixedclipping_mod"
            log.warning("%s expects every hospital to clip its update with Flower's %s; fedmed's own ClientApp does "
                        "not install it: give the hospitals a ClientApp of their own with it (docs/own-clientapp.md), "
                        "or the noise is not calibrated to any clipping", type(client_side[0]).__name__, mod)
