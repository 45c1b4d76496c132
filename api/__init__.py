"""Online inference (REST, FastAPI): arrives with the serving issue. Reads a serving store
from ``embedding_server``; never imports ``dense_trainer``."""
