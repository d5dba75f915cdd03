"""FedMEPD (docs/fedmepd.md): modality-specific encoders, a per-filter personalised fusion decoder, a server that
trains on its own full-modality cases, multi-anchor LACCA; and the baselines it is compared with.

``settings.py``, ``harness.py`` (what FedMEPD and its baselines share), ``filter_personalisation.py``,
``anchors.py``, ``decoder.py``, ``server.py``, ``hospital.py``, ``baselines.py``, ``strategy.py``.
"""

from common.methods.registry import BRAIN, MethodSpec

SETTINGS = "strategies.fedmepd.settings:FedMEPDSettings"

#: why Flower's DP wrappers cannot take the replies of the methods with modality-specific encoders
PARTIAL_ENCODERS = ("a hospital returns only the encoders of its own modalities (and the anchors), not the whole model "
                    "the wrapper clips its reply against")

METHODS = (
    MethodSpec("fedmepd", BRAIN, server="strategies.fedmepd.server:FedMEPDServer",
               hospital="strategies.fedmepd.hospital:FedMEPDHospital",
               strategy="strategies.fedmepd.strategy:FedMEPDStrategy",
               summary="Modality-specific encoders, per-filter personalised fusion decoder, multi-anchor LACCA",
               settings=SETTINGS, section="fedmepd", model_needs="multimodal", not_for_central_dp=PARTIAL_ENCODERS,
               secure="strategies.fedmepd.secure:SECURE", privacy="strategies.fedmepd.privacy:RULES"),
    MethodSpec("fedmepd-fedavg", BRAIN, server="strategies.fedmepd.baselines:SharedEncoderFedAvgServer",
               hospital="strategies.fedmepd.baselines:SharedEncoderFedAvgHospital",
               strategy="strategies.fedmepd.strategy:SharedEncoderFedAvgStrategy",
               summary="Baseline: FedAvg of the whole model with one encoder shared by all modalities",
               model_needs="multimodal", secure="common.trust.secure_aggregation.methods:MEAN_UPDATE",
               privacy="strategies.fedmepd.privacy:BASELINE_RULES"),
    MethodSpec("fedmepd-federated-decoder", BRAIN, server="strategies.fedmepd.baselines:FederatedDecoderServer",
               hospital="strategies.fedmepd.baselines:FederatedDecoderHospital",
               strategy="strategies.fedmepd.strategy:FederatedDecoderStrategy",
               summary="Baseline: modality-specific encoders with a fully federated fusion decoder",
               model_needs="multimodal", not_for_central_dp=PARTIAL_ENCODERS,
               secure="strategies.fedmepd.secure:SECURE", privacy="strategies.fedmepd.privacy:BASELINE_RULES"),
    MethodSpec("fedmepd-local", BRAIN, server="strategies.fedmepd.baselines:LocalServer",
               hospital="strategies.fedmepd.baselines:LocalHospital",
               strategy="strategies.fedmepd.strategy:LocalOnlyStrategy",
               summary="Baseline: every hospital (and the server) trains alone", model_needs="multimodal",
               not_for_central_dp="every hospital trains alone: nothing is aggregated for the wrapper to protect",
               not_secure="its hospitals send nothing to aggregate",
               privacy="strategies.fedmepd.privacy:BASELINE_RULES"),
)
