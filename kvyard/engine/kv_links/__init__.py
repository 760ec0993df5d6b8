"""The engine's links to KV outside its device cache: the KV tier, pulls from a prefill replica, exports to a decode
replica, and whole-block copies between the device cache and host memory."""
