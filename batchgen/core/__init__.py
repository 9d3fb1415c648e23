"""The torch-free core: requests, the scheduler, the KV block manager and KV sizing."""
