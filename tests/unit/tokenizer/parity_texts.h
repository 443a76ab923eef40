// Texts of the tokenizer parity tests: many scripts, emoji, digit runs, whitespace runs,
// contractions, special tokens written in the text, and edge cases of the pre-tokenizer regex.
#pragma once

#include <string>
#include <vector>

namespace titan::test {

inline std::vector<std::string> parity_texts() {
  std::vector<std::string> t = {
      "Hello world! The caf\u00e9's na\u00efve fa\u00e7ade \u2014 d\u00e9j\u00e0 vu. I'LL say it's they'RE here; "
      "we've, I'd, you'll, she's, DON'T, WON'T, IT'S, I'M, HE'D, WE'VE, 'S 'T, it\u2019s.",
      "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0421\u044a\u0435\u0448\u044c \u0436\u0435 "
      "\u0435\u0449\u0451 \u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 \u0431\u0443\u043b\u043e\u043a.",
      "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5\u00b7 \u03be\u03b5\u03c3\u03ba"
      "\u03b5\u03c0\u03ac\u03b6\u03c9 \u03c4\u03b7\u03bd \u03c8\u03c5\u03c7\u03bf\u03c6\u03b8\u03cc\u03c1\u03b1.",
      "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c\u8fd8\u6709\ud55c\uad6d"
      "\uc5b4 \ubb38\uc7a5\u3002",
      "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0647\u0630\u0627 \u0646\u0635 "
      "\u0639\u0631\u0628\u064a.",
      "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964 \u092f\u0939 \u0939\u093f\u0902"
      "\u0926\u0940 \u092a\u093e\u0920 \u0939\u0948\u0964",
      "Emoji \U0001F600\U0001F44D\U0001F3FD family \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 flag "
      "\U0001F1EB\U0001F1F7 heart \u2764\uFE0F end",
      "1 12 123 1234 12345 1234567890 3.14159 2024-01-01 \u0663\u0664\u0665\u0666 \u0967\u0968\u0969\u096a x9y99z",
      "a  b   c\tt\t\td\n\ne \n \n  f   \r\n g    ",
      "   leading spaces and trailing   ",
      "<|begin_of_text|>Hello<|end_of_text|> <|begin_of_text|><|begin_of_text|>x<|end_of_text|>",
      "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|reserved_special_token_42|> <|end",
      "a\u180eb c\u0085d e\u00a0f g\u2003h i\u3000j \u2028k",
      "def f(x):\n    return x**2  # comment\n\tif y != 0: pass\n\n\n",
      "hello world, hello  world",
      "",
      " ",
      "\n",
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
  };
  t.push_back(std::string(300, 'q') + " " + std::string(200, '!') + " " + std::string(150, ' ') + "x");
  std::string all;
  for (const auto& s : t) all += s + "\n";
  t.push_back(all);
  return t;
}

}  // namespace titan::test
