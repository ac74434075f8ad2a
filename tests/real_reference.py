"""Literal transcriptions of openvalidators 1.2.0 for the real-checkpoint tier (tests/test_real_*.py).

Written from the reference's code, not from rewardstack's: `MpnetRelevenceModel` (relevance's
second model), `DiversityRewardModel` (with its history), torchmetrics' `pairwise_cosine_similarity`
(which both call), and `DirectPreferenceRewardModel.reward_single` with its `logit_penalty`. Each
runs one call at a time on its own model and tokenizer, in the dtype it is given, as the reference
does (the relevance model embeds one string per call; diversity embeds a step's completions in one
padded batch). Only device handling and bittensor logging are left out.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.nn.functional as F


def _safe_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torchmetrics.utilities.compute._safe_matmul."""
    if x.is_cuda or x.dtype != torch.float16:
        return x @ y.T
    return (x.float() @ y.T.float()).half()


def pairwise_cosine_similarity(x: torch.Tensor, y: torch.Tensor | None = None,
                               zero_diagonal: bool | None = None) -> torch.Tensor:
    """torchmetrics.functional.pairwise_cosine_similarity (reduction None): x, y [N, d], [M, d]."""
    if y is None:
        y = x
        zero_diagonal = True if zero_diagonal is None else zero_diagonal
    else:
        zero_diagonal = False if zero_diagonal is None else zero_diagonal
    norm = torch.norm(x, p=2, dim=1)
    x = x / norm.unsqueeze(1)
    norm = torch.norm(y, p=2, dim=1)
    y = y / norm.unsqueeze(1)
    distance = _safe_matmul(x, y)
    if zero_diagonal:
        distance.fill_diagonal_(0)
    return distance


def mean_pooling(model_output: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """openvalidators.reward.relevance.mean_pooling (the sentence-transformers pooling)."""
    token_embeddings = model_output[0]
    input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
    return torch.sum(token_embeddings * input_mask_expanded, 1) / torch.clamp(input_mask_expanded.sum(1), min=1e-9)


class MpnetRelevenceModel:
    """openvalidators.reward.relevance.MpnetRelevenceModel (the class name is the reference's)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def get_embeddings(self, sentences: List[str] | str) -> torch.Tensor:
        # Tokenizing sentences
        encoded_input = self.tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
        # Compute token embedding
        with torch.no_grad():
            embeddings = self.model(**encoded_input)
        # Pooling
        sentence_embeddings = mean_pooling(embeddings, encoded_input["attention_mask"])
        # Normalizing
        sentence_embeddings = F.normalize(sentence_embeddings, p=2, dim=1)
        return sentence_embeddings

    def reward(self, prompt: str, completion: str) -> torch.Tensor:
        # Get the two bert embeddings.
        completion_embedding = self.get_embeddings(completion)
        prompt_embedding = self.get_embeddings(prompt)
        # Calculate the RMSE distance for the 2 embeddings.
        similarity = pairwise_cosine_similarity(prompt_embedding, completion_embedding)
        # Return the 1 - similarity.
        return torch.abs(similarity)


class DiversityRewardModel:
    """openvalidators.reward.diversity.DiversityRewardModel, its history included."""

    def __init__(self, model: Any, tokenizer: Any, historic_embeddings: torch.Tensor | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.reward_bottom_k = 2
        self.history_reward_bottom_k = 2
        self.historic_embeddings = torch.tensor([]) if historic_embeddings is None else historic_embeddings.clone()
        self.history_range = (500, 15500)

    def get_embeddings(self, sentences: List[str]) -> torch.Tensor:
        # Tokenizing sentences
        encoded_input = self.tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
        # Compute token embedding
        with torch.no_grad():
            embeddings = self.model(**encoded_input)
        # Pooling
        sentence_embeddings = mean_pooling(embeddings, encoded_input["attention_mask"])
        # Normalizing
        sentence_embeddings = F.normalize(sentence_embeddings, p=2, dim=1)
        return sentence_embeddings

    def update_historic_embeddings(self, embeddings: torch.Tensor) -> None:
        def unique(embeddings: torch.Tensor) -> torch.Tensor:
            unique_embeddings = [embeddings[0]]
            last_emb = embeddings[0]
            for emb in embeddings:
                if not torch.all(torch.eq(emb, last_emb)):
                    unique_embeddings.append(emb)
                last_emb = emb
            return torch.stack(unique_embeddings)

        embeddings_unique = unique(embeddings)
        historic_embeddings = torch.cat([self.historic_embeddings, embeddings_unique])
        self.historic_embeddings = historic_embeddings[-self.history_range[1]:, :]

    def get_historic_rewards(self, embeddings: torch.Tensor) -> torch.Tensor | None:
        def regularise(rewards: torch.Tensor) -> torch.Tensor:
            # sigmoid function that cutoff at 0.05 approximately
            return 1 / (1 + torch.exp(-1000 * rewards + 50))

        # Return None if history size is too small
        if self.historic_embeddings.shape[0] < (self.history_range[0] + self.history_reward_bottom_k):
            return None
        # Calculate the pairwise cosine similarity.
        similarity = pairwise_cosine_similarity(embeddings, self.historic_embeddings[self.history_range[0]:])
        # Reward to be at the bottom_k smallest of the 1 - similarity score.
        rewards = torch.topk((1 - torch.abs(similarity)), self.history_reward_bottom_k, largest=False)[0][:, -1]
        return regularise(rewards)

    def get_batch_rewards(self, embeddings: torch.Tensor) -> torch.Tensor:
        def regularise(rewards: torch.Tensor) -> torch.Tensor:
            # sigmoid function that maps 0.07 -> 0.23; 0.1 -> 0.5; 0.2 -> 0.98
            return 1 / (1 + torch.exp(-40 * rewards + 4))

        # Calculate the pairwise cosine similarity.
        similarity = pairwise_cosine_similarity(embeddings, embeddings)
        # Reward to be at the 10% quantile of the 1 - similarity score.
        rewards = torch.topk((1 - torch.abs(similarity)), self.reward_bottom_k, largest=False)[0][:, -1]
        return regularise(rewards)

    def get_rewards(self, prompt: str, completions: List[str], name: str) -> torch.Tensor:
        # Check if completions are empty, return 0 if so
        if len(completions) == 0:
            return torch.tensor([])
        # Get embeddings for all completions.
        embeddings = self.get_embeddings(completions)
        # Get batch rewards.
        batch_rewards = self.get_batch_rewards(embeddings)
        # get historic rewards.
        historic_rewards = self.get_historic_rewards(embeddings)
        self.update_historic_embeddings(embeddings)
        # Return all
        if historic_rewards is not None:
            return batch_rewards * historic_rewards
        else:
            return batch_rewards


class DirectPreferenceRewardModel:
    """openvalidators.reward.dpo.DirectPreferenceRewardModel: `reward_single` and `logit_penalty`."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.penalty = 1.2  # Same penalty as the original [paper](https://arxiv.org/pdf/1909.05858.pdf).

    def reward_single(self, prompt: str, completion: str, name: str, with_penalty: bool = True) -> float:
        with torch.no_grad():
            # Check if completion is
            if completion.strip() == "" or len(completion) <= 5:
                return -11  # exp(-11)=1.67e-5 < 2e-5=1/50257 (typical vocab size)
            # Tokenize the combined prompt + completion.
            combined = self.tokenizer(prompt + completion, return_tensors="pt").input_ids[0]  # [seq_len]
            # Tokenize only the prompt, to help determine prompt token length.
            prompt_part = self.tokenizer(prompt, return_tensors="pt").input_ids[0]  # [prompt_len]
            # Completion doesn't fit into model sequence, so return lowest reward.
            if self.tokenizer.model_max_length <= len(prompt_part):
                return -11.0  # exp(-11)=1.67e-5 < 2e-5=1/50257 (typical vocab size)
            # Truncate combined to fit into model max sequence length.
            if self.tokenizer.model_max_length < len(combined):
                combined = combined[: self.tokenizer.model_max_length]
            labels = combined.clone()  # [seq_len]
            # Ignore prompt part for calculating reward.
            labels[: len(prompt_part)] = -100
            # Label only each next token prediction ground-truth.
            labels = labels[1:]  # [seq_len-1]
            loss_mask = labels != -100  # [seq_len-1]
            # Dummy token to allow for indexing, but loss will be ignored.
            labels[labels == -100] = 0
            # Reshape for gather operation.
            labels = labels.unsqueeze(0).unsqueeze(2)  # [batch_size=1, seq_len-1, :]
            # Forward pass to calculate logit predictions for each sequence position.
            logits = self.model(combined.unsqueeze(0)).logits  # [batch_size=1, seq_len, vocab_len]
            # Predict only where labels are available.
            logits = logits[:, :-1, :]  # [batch_size=1, seq_len-1, vocab_len]
            if with_penalty:
                # Apply penalty for repeated generation
                for i in range(len(prompt_part) + 1, len(combined) - 1):
                    logit = logits[:, i, :].clone()
                    inputs = combined[len(prompt_part): i].clone()
                    logits[:, i, :] = self.logit_penalty(input_ids=inputs, logit=logit)
            # Rescale via log(softmax(logits)).
            logits = logits.log_softmax(-1)
            # Calculate the model's log-probability for each actual completion token.
            per_token_logps = torch.gather(logits, dim=2, index=labels).squeeze(2)  # [batch_size=1, seq_len-1]
            # Average log-probability over completion sequence.
            reward = (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)  # [batch_size=1]
            reward = reward[0].cpu().detach()
            # NaNs can possibly arise through log(0)=-inf, replace with suitably small logits.
            if torch.isnan(reward) or torch.isinf(reward):
                return -11.0  # exp(-11)=1.67e-5 < 2e-5=1/50257 (typical vocab size)
            return reward.item()

    def logit_penalty(self, input_ids: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
        # Counts the unique tokens within each generation
        uniques, counts = input_ids.unique(return_counts=True)
        score = torch.gather(logit, 1, uniques.unsqueeze(0))
        # if score < 0 then repetition penalty has to be multiplied to reduce the previous token probability
        score = torch.where(score < 0, score * (self.penalty**counts), score / (self.penalty**counts))
        logit.scatter_(1, uniques.unsqueeze(0), score.to(logit.dtype))
        return logit
