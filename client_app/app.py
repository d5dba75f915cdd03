"""fedmed's ClientApp: the hospital-side API's three handlers (``client_app/api.py``), nothing else, so a ClientApp
of your own with your own mods (docs/own-clientapp.md) answers exactly as this one does."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .api import Hospital

app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    """Which hospital this is, how many training samples it has, and what it declares (modalities, bit-width)."""
    return Hospital(context).answer(message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """The method's local step on this hospital's data; the reply also scores the received model."""
    return Hospital(context).answer(message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Flower's evaluate phase and the end-of-run cross-site evaluation, on this hospital's validation data."""
    return Hospital(context).answer(message)
