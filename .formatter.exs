[
  inputs: ["{mix,.formatter}.exs", "elixir/{lib,test}/**/*.{ex,exs}"]
]
