"""FedProto (Tan et al. 2022): hospitals keep their own models and share only per-class mean features."""

from common.methods.registry import MethodSpec

METHODS = (
    MethodSpec("fedproto", ("classification",), server="strategies.fedproto.server:FedProtoServer",
               hospital="strategies.fedproto.hospital:FedProtoHospital",
               strategy="strategies.fedproto.strategy:FedProtoStrategy",
               summary="Personal models that share per-class mean features (prototypes)",
               settings="strategies.fedproto.settings:FedProtoSettings", section="fedproto", model_needs="features",
               privacy="strategies.fedproto.privacy:RULES",
               not_for_central_dp="hospitals share per-class mean features (prototypes), not a model: "
               "there are no weights for the wrapper to clip",
               not_secure="FedProto's replies are each hospital's class means and the server keeps per-hospital "
                          "state; the count-weighted means could be summed as FedProIn's prototypes are, which is "
                          "not built yet"),
)
