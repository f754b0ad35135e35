defmodule VllmBridge.MultiNode do
  @moduledoc false
  # Helpers for tests that span BEAM nodes on loopback: make this node
  # distributed (starting epmd when it is not running), start peers with this
  # node's code paths, and start the app and a pool on a peer under the app's
  # own supervisor (not linked to any test process).

  import ExUnit.Assertions

  @cookie :vllm_bridge_multi_node_test

  @doc """
  Makes this node distributed on 127.0.0.1 (long names). Starts epmd first
  when nothing answers on its port; `mix test` itself does not.
  """
  def ensure_distributed! do
    if Node.alive?() do
      node()
    else
      ensure_epmd!()
      name = :"vllm_bridge_test_#{System.pid()}_#{System.unique_integer([:positive])}@127.0.0.1"

      case start_node(name, 20) do
        {:ok, _} ->
          Node.set_cookie(@cookie)
          node()

        {:error, reason} ->
          flunk("""
          cannot make this node distributed (#{inspect(reason)}).
          Erlang distribution needs epmd on port 4369 (started here with
          `epmd -daemon`) and loopback TCP; see docs/deploy.md.
          """)
      end
    end
  end

  defp ensure_epmd! do
    case :erl_epmd.names(~c"127.0.0.1") do
      {:ok, _names} ->
        :ok

      {:error, _} ->
        epmd = System.find_executable("epmd") || flunk("no epmd executable on PATH")
        {_, 0} = System.cmd(epmd, ["-daemon"], stderr_to_stdout: true)
    end
  end

  # epmd -daemon returns before it listens: retry for a few seconds.
  defp start_node(name, tries) do
    case Node.start(name, :longnames) do
      {:ok, _} = ok ->
        ok

      {:error, _} = error when tries <= 1 ->
        error

      {:error, _} ->
        Process.sleep(200)
        start_node(name, tries - 1)
    end
  end

  @doc """
  Starts a peer node on 127.0.0.1 with this node's cookie and code paths and
  the `:vllm_bridge` application running. Returns `{peer_pid, node}`; the
  peer is linked to the caller (stop it with `stop_peer/1`).
  """
  def start_peer!(prefix) do
    name = :"#{prefix}_#{System.pid()}_#{System.unique_integer([:positive])}"

    {:ok, peer, node} =
      :peer.start_link(%{
        name: name,
        host: ~c"127.0.0.1",
        longnames: true,
        # peers talk only to this node (no full mesh between peers), so that
        # stopping one peer does not disturb the others
        args: [
          ~c"-setcookie",
          Atom.to_charlist(Node.get_cookie()),
          ~c"-connect_all",
          ~c"false"
        ],
        wait_boot: 30_000
      })

    :ok = :erpc.call(node, :code, :add_pathsa, [:code.get_path()])
    {:ok, _} = :erpc.call(node, Application, :ensure_all_started, [:vllm_bridge])
    {peer, node}
  end

  @doc "Starts a `VllmBridge.Pool` on `node` under the app's supervisor there."
  def start_remote_pool!(node, opts) do
    spec = Supervisor.child_spec({VllmBridge.Pool, opts}, id: Keyword.fetch!(opts, :name))
    {:ok, _pid} = :erpc.call(node, Supervisor, :start_child, [VllmBridge.Supervisor, spec])
    :ok
  end

  @doc "Stops a peer node; harmless when it is already gone."
  def stop_peer(peer) do
    :peer.stop(peer)
  catch
    :exit, _ -> :ok
  end
end
