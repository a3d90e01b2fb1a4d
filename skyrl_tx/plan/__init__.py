"""Memory planning: the tensors a model holds (inventory), what each device needs at the peak (memory), the start-up
check (capacity), published configs for real-shape tests (published) and the `skyrl-tx plan` command."""
