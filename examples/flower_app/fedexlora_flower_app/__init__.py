"""Your own Flower app, federated with FedEx-LoRA (see docs/API.md, 'Flower')."""
