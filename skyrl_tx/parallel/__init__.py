"""Scale-out across ranks: process groups (group.py); data- and tensor-parallel plans build on them."""
