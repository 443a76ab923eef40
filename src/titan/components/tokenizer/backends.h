// The tokenizer implementations behind load_tokenizer (tokenizer.h). Each throws titan::UserError
// naming `path` when the file is not of its kind or uses features titan does not support.
#pragma once

#include "titan/components/tokenizer/tokenizer.h"

#include <memory>
#include <string>

namespace titan::tokenizer {

// Hugging Face tokenizer.json with a byte-level BPE model (hf_tokenizer.cpp).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);

// tiktoken model file ("base64(token) rank" lines) with Llama 3's pattern and special tokens
// (tiktoken_tokenizer.cpp).
std::unique_ptr<Tokenizer> load_tiktoken_tokenizer(const std::string& path);

// The 256 special tokens Llama 3 appends after its tiktoken base vocabulary, in id order.
std::vector<std::string> llama3_special_tokens();

// SentencePiece model (sentencepiece_tokenizer.cpp).
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& path);

// Whether the first line of the file at `path` looks like a tiktoken line ("<base64> <integer>").
bool looks_like_tiktoken(const std::string& path);

}  // namespace titan::tokenizer
