"""The demo, shipped in the wheel so ``weightsync demo`` runs from any install: an asynchronous
CartPole actor-learner (``cartpole``) and the RL-loop pieces the repository's examples share
(``loop``). Nothing here is imported by ``import weightsync``."""
