"""encache."""
