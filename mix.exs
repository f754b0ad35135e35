defmodule VllmBridge.MixProject do
  use Mix.Project

  def project do
    [
      app: :vllm_bridge,
      version: "0.1.0",
      elixir: "~> 1.14",
      elixirc_paths: ["elixir/lib"],
      test_paths: ["elixir/test"],
      start_permanent: Mix.env() == :prod,
      deps: [],
      docs: [main: "readme", extras: ["README.md", "docs/protocol.md"]]
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {VllmBridge.Application, []}]
  end
end
