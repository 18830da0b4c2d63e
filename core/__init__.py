"""Small pieces every package needs: atomic writes, robust image loading, errors."""
