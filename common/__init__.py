"""Code shared by the engine, gateway and tierstore services.

Nothing here imports from engine/, gateway/ or tierstore/.
"""
