"""custom_mods: A Flower app with custom mods."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from custom_mods.task import Net

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    num_rounds = context.run_config["num-server-rounds"]
    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds,
                            train_config=ConfigRecord({"lr": 0.01}))
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
