Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.ErrorTest do
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Runtime}

  @moduletag timeout: 60_000

  describe "Exception.message/1" do
    test "names the Python type once when the message starts with it" do
      error = %Error{
        category: :python,
        message: "ValueError: 5 is not divisible by 2",
        python_type: "ValueError"
      }

      assert Exception.message(error) == "(python) ValueError: 5 is not divisible by 2"
    end

    test "adds the type when the message does not start with it" do
      error = %Error{category: :python, message: "boom", python_type: "RuntimeError"}
      assert Exception.message(error) == "(python) RuntimeError: boom"

      # a type named inside the message, not as its prefix, is not the prefix
      error = %{error | message: "internal error: RuntimeError: boom"}

      assert Exception.message(error) ==
               "(python) RuntimeError: internal error: RuntimeError: boom"
    end

    test "keeps the traceback after the message" do
      error = %Error{
        category: :python,
        message: "KeyError: 'x'",
        python_type: "KeyError",
        python_traceback: "Traceback (most recent call last): ..."
      }

      assert Exception.message(error) ==
               "(python) KeyError: 'x'\n\nTraceback (most recent call last): ..."
    end

    test "a real worker's Python error names its type once", %{test: test} do
      pool = start_pool!(:"#{test}", 1)
      rt = [__runtime__: [pool: pool]]
      {:ok, counter} = Runtime.call_class("Counter", [], rt)

      assert {:error, %Error{category: :python, python_type: "ValueError"} = error} =
               Runtime.call_method(counter, "fail", ["5 is not divisible by 2"])

      [first_line | _] = String.split(Exception.message(error), "\n")
      assert first_line == "(python) ValueError: 5 is not divisible by 2"
    end
  end
end
