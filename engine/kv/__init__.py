"""KV memory primitives: the hash chain that names state, the page and slot pools,
and the device tensors that hold state. They depend on a geometry record
(`StateShape`), never on the model config, so model, cache and tiers can all
import them without importing each other."""
