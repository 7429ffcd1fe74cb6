"""The shape of pytorch/tutorials intermediate_source/seq2seq_translation_tutorial.py (its
attention decoder version), in miniature: a GRU encoder called once per input token, its outputs
copied into a buffer the script made (`encoder_outputs[ei] = encoder_output[0, 0]`), an attention
decoder called once per target token with teacher forcing chosen by Python's `random.random()`,
the loss summed over the decoder's calls (`loss += criterion(...)`) and a `.item()` break on EOS,
one backward and two optimizers (encoder's, decoder's) stepped one after the other. Run as
`python seq2seq_loop.py --pairs FILE [options]`; FILE holds `source<TAB>target` lines."""

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn, optim

SOS_token, EOS_token, MAX_LENGTH = 0, 1, 8


class Lang:
    def __init__(self):
        self.word2index, self.n_words = {}, 2

    def add(self, sentence):
        for word in sentence.split(" "):
            if word not in self.word2index:
                self.word2index[word] = self.n_words
                self.n_words += 1


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output, hidden = self.gru(embedded, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1, max_length=MAX_LENGTH):
        super().__init__()
        self.hidden_size, self.output_size = hidden_size, output_size
        self.embedding = nn.Embedding(self.output_size, self.hidden_size)
        self.attn = nn.Linear(self.hidden_size * 2, max_length)
        self.attn_combine = nn.Linear(self.hidden_size * 2, self.hidden_size)
        self.dropout = nn.Dropout(dropout_p)
        self.gru = nn.GRU(self.hidden_size, self.hidden_size)
        self.out = nn.Linear(self.hidden_size, self.output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


def tensorFromSentence(lang, sentence):
    indexes = [lang.word2index[word] for word in sentence.split(" ")] + [EOS_token]
    return torch.tensor(indexes, dtype=torch.long).view(-1, 1)


def train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer, decoder_optimizer,
          criterion, teacher_forcing_ratio):
    encoder_hidden = encoder.initHidden()
    encoder_optimizer.zero_grad()
    decoder_optimizer.zero_grad()
    input_length = input_tensor.size(0)
    target_length = target_tensor.size(0)
    encoder_outputs = torch.zeros(MAX_LENGTH, encoder.hidden_size)
    loss = 0
    for ei in range(input_length):
        encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
        encoder_outputs[ei] = encoder_output[0, 0]
    decoder_input = torch.tensor([[SOS_token]])
    decoder_hidden = encoder_hidden
    use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False
    if use_teacher_forcing:
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            loss += criterion(decoder_output, target_tensor[di])
            decoder_input = target_tensor[di]
    else:
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            topv, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()
            loss += criterion(decoder_output, target_tensor[di])
            if decoder_input.item() == EOS_token:
                break
    loss.backward()
    encoder_optimizer.step()
    decoder_optimizer.step()
    return loss.item() / target_length


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", required=True)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--teacher-forcing", type=float, default=0.5)
    parser.add_argument("--print-every", type=int, default=1)
    args = parser.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    with open(args.pairs) as f:
        pairs = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    input_lang, output_lang = Lang(), Lang()
    for src, tgt in pairs:
        input_lang.add(src)
        output_lang.add(tgt)
    encoder = EncoderRNN(input_lang.n_words, args.hidden)
    decoder = AttnDecoderRNN(args.hidden, output_lang.n_words, dropout_p=0.1)
    encoder_optimizer = optim.SGD(encoder.parameters(), lr=args.lr)
    decoder_optimizer = optim.SGD(decoder.parameters(), lr=args.lr)
    training_pairs = [(tensorFromSentence(input_lang, p[0]), tensorFromSentence(output_lang, p[1]))
                      for p in (random.choice(pairs) for _ in range(args.iters))]
    criterion = nn.NLLLoss()
    for it in range(1, args.iters + 1):
        input_tensor, target_tensor = training_pairs[it - 1]
        loss = train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer,
                     decoder_optimizer, criterion, args.teacher_forcing)
        if it % args.print_every == 0:
            print(f"iter {it} loss {loss:.4f}")
