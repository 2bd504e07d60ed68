"""What users give gpumem, read and checked: the environment's variables (environment), limits,
segment kinds, limit scopes, floors, sizes, devices, files from outside; and their text echoed back
in messages (echo). The bottom layer: it imports nothing of gpumem's but itself and the compiled
module, so every feature can use it and none is needed to check a setting."""
