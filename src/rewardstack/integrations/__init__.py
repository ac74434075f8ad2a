"""Adapters that let existing validator code use rewardstack (`openvalidators`)."""
