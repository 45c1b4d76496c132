"""Data: the Criteo-layout reader, the background loader and the planted-teacher generator."""
