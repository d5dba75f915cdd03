"""What every method shares, plain PyTorch/NumPy (the ground floor): named arrays and payloads, the run config,
data, models, tasks, quantisation, what a method is made of (methods/), the round engine (engine/), and what a
hospital's trust rests on (trust/)."""
