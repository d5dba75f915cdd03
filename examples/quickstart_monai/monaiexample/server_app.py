"""monaiexample: A Flower / MONAI app."""

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from monaiexample.task import load_model

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    model = load_model()
    arrays = ArrayRecord(model.state_dict())
    strategy = FedAvg(fraction_train=fraction_train)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    final_model_name = "final_model.pt"
    print(f"\nSaving {final_model_name} to disk...")
    torch.save(result.arrays.to_torch_state_dict(), final_model_name)
