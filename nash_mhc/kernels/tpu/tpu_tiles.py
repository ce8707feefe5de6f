"""The TPU vector register's shape, which every Pallas TPU kernel here builds its tiles from."""

LANES = 128  # lanes per vector register: a tile's last dimension is a whole number of them
SUBLANES = 8  # float32 rows per vector register: a tile's second-to-last dimension is a multiple of it
