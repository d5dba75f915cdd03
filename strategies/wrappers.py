"""Flower's strategy wrappers (its DP wrappers) around one of ours: found, and refused where they cannot work."""

from __future__ import annotations

import logging
import sys

from flwr.serverapp.strategy import Strategy

from common.config import ConfigError
from common.methods.registry import method_spec, methods

log = logging.getLogger("fedmed")

class FlowerWrappers:
    # --- Flower's wrappers --------------------------------------------------------------------------
    def wrappers(self) -> list[Strategy]:
        """The strategies wrapping this one (``wrapper.strategy is self``, and their own wrappers), found on the call
        stack: a wrapper such as Flower's DP wrappers is built around a strategy without telling it, and calls the
        strategy's hooks (``summary``, ``configure_train``) from its own."""
        found: list[Strategy] = []
        inner: Strategy = self
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not inner and isinstance(owner, Strategy) and getattr(owner, "strategy", None) is inner:
                found.append(owner)
                inner = owner
            frame = frame.f_back
        return found

    def refuse_unfit_wrappers(self) -> None:
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
        if self.secure_aggregation is not None:
            raise ConfigError(f"{wrapper} with secure aggregation (secure-aggregation.enabled): hospitals send "
                              "masked sums, never the update of one hospital that the wrapper clips (and that Flower's "
                              "clipping mod would clip after masking). Nothing was sent to the hospitals. For DP with "
                              "secure aggregation use each hospital's own local DP (its policy's local-dp, "
                              "docs/privacy.md)")
        client_side = [w for w in dp if isinstance(w, (ClientFixed, ClientAdaptive))]
        if client_side and not self._warned_client_dp:
            self._warned_client_dp = True
            mod = "adaptiveclipping_mod" if isinstance(client_side[0], ClientAdaptive) else "fixedclipping_mod"
            log.warning("%s expects every hospital to clip its update with Flower's %s; fedmed's own ClientApp does "
                        "not install it: give the hospitals a ClientApp of their own with it (docs/own-clientapp.md), "
                        "or the noise is not calibrated to any clipping", type(client_side[0]).__name__, mod)
