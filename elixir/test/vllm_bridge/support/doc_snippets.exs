defmodule VllmBridge.DocSnippets do
  @moduledoc false
  # The ```elixir blocks of a Markdown file, and the run options the line before
  # each fence gives (`<!-- run: ... -->`, see guide_test.exs).

  # {file, line, options, code} for every ```elixir block of `path`.
  @doc "`{file, line, options, code}` for every elixir block of the Markdown file `path`."
  def blocks(path) do
    lines = path |> File.read!() |> String.split("\n")

    lines
    |> Enum.with_index(1)
    |> Enum.filter(fn {line, _} -> String.trim(line) == "```elixir" end)
    |> Enum.map(fn {_, fence} ->
      body = lines |> Enum.drop(fence) |> Enum.take_while(&(String.trim(&1) != "```"))
      before = lines |> Enum.take(fence - 1) |> Enum.reverse() |> Enum.find("", &(&1 != ""))
      {Path.basename(path), fence + 1, options(before), Enum.join(body, "\n")}
    end)
  end

  @doc "The code of the elixir blocks of `path` in the section under `heading` (the whole line)."
  def in_section(path, heading) do
    lines = path |> File.read!() |> String.split("\n")
    headings = section_headings(lines)

    for {_file, line, _options, code} <- blocks(path),
        Map.get(headings, line - 1) == heading,
        do: code
  end

  # Line number of each fence -> the heading it is under (lines inside fences are code).
  defp section_headings(lines) do
    {headings, _, _} =
      lines
      |> Enum.with_index(1)
      |> Enum.reduce({%{}, nil, false}, fn {line, number}, {map, heading, fenced} ->
        trimmed = String.trim(line)

        cond do
          String.starts_with?(trimmed, "```") and not fenced ->
            {Map.put(map, number, heading), heading, true}

          String.starts_with?(trimmed, "```") ->
            {map, heading, false}

          not fenced and String.starts_with?(line, "#") ->
            {map, line, fenced}

          true ->
            {map, heading, fenced}
        end
      end)

    headings
  end

  defp options(line) do
    case Regex.run(~r/<!--\s*run:\s*(.*?)\s*-->/, line) do
      nil -> []
      [_, words] -> words |> String.split() |> Enum.map(&option/1)
    end
  end

  defp option("start_children"), do: :start_children
  defp option("torchless"), do: :torchless

  defp option("pool=" <> spec) do
    [name, size] = String.split(spec, ":")
    {:pool, Module.concat([name]), String.to_integer(size)}
  end
end
