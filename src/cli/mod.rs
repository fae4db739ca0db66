//! Subcommands for operators, besides `daemon`.

pub mod check;
